"""Row-reduction network: a pipelined binary tree over the C PEs of a PE row
that computes the row max or the row sum of the PEs' ``T`` values.

Design trade-off
----------------
The softmax needs two reductions per row and kv tile (max, then sum).  A
tree has log2(C) adder levels; a linear chain through the PEs would need C
steps and keep the PEs' adders busy.  The nodes are pipelined, so a new
reduction can enter every cycle (the sequencer interleaves the wr rows of a
PE) and the critical path is one adder stage.  One node holds both an
``Fp32Max`` and an ``Fp32AddSub`` (a max node is small next to the adder,
and sharing the wires and registers halves the tree).

The pairing is exactly ``numerics.tree_reduce``: level k combines
neighbours (2i, 2i+1) of level k-1; the result is bit-exact whatever the
operand order inside a node (max32 is a total order, add32 commutes).

Dataflow (C = 8)::

    T[0] T[1] T[2] T[3] T[4] T[5] T[6] T[7]     leaves (PE outputs, cycle x; each [n]
                                                 is a 3-stage node + level register)
      └─┬─┘     └─┬─┘     └─┬─┘     └─┬─┘
       [n]       [n]       [n]       [n]        level 1 register (x+4)
        └────┬────┘         └────┬────┘
            [n]                 [n]             level 2 register (x+8)
             └─────────┬─────────┘
                      [n]                       level 3 register (x+12) = res

Each node is itself pipelined (``NODE_LATENCY`` adder stages, the max
delayed to match), so a level takes ``NODE_LATENCY + 1`` cycles and the
longest register-to-register path is one adder stage.  ``res`` is valid
``LATENCY = log2 C * (NODE_LATENCY + 1)`` cycles after the injection cycle,
carrying the injection's tag; the array latches it into the row's return
registers (one more cycle) and broadcasts it back to every PE of the row.
"""

from amaranth.hdl import Module, Mux, Signal
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from .fpu import DESIGN_LATENCY, Fp32AddSub, Fp32Max
from .pe import TreeOp

__all__ = ["ReduceNode", "RowReduce", "NODE_LATENCY", "tree_latency"]


#: Pipeline registers inside a node (the adder's design latency); the
#: level register after the node adds one more cycle per tree level.
NODE_LATENCY = DESIGN_LATENCY[Fp32AddSub]


def tree_latency(cols: int) -> int:
    """Cycles from an injection to the tree's result for ``cols`` leaves:
    log2(cols) levels of ``NODE_LATENCY`` + 1 cycles."""
    return (cols.bit_length() - 1) * (NODE_LATENCY + 1)


class ReduceNode(wiring.Component):
    """One tree node, ``o = sum ? add32(a, b) : max32(a, b)`` of the operands
    of ``NODE_LATENCY`` cycles ago (the adder pipelined, the max delayed to
    match).

    Ports
    -----
    a, b : In(32)   binary32 operands (left, right neighbour)
    sum : In(1)     1: add, 0: max
    o : Out(32)     result, ``NODE_LATENCY`` cycles later
    """

    a: In(32)
    b: In(32)
    sum: In(1)
    o: Out(32)

    def elaborate(self, platform):
        m = Module()
        m.submodules.add = add = Fp32AddSub(NODE_LATENCY)
        m.submodules.mx = mx = Fp32Max()
        mx_d, sum_d = mx.o, self.sum
        for i in range(NODE_LATENCY):
            mx_n, sum_n = Signal(32, name=f"max{i + 1}"), Signal(name=f"sum{i + 1}")
            m.d.sync += [mx_n.eq(mx_d), sum_n.eq(sum_d)]
            mx_d, sum_d = mx_n, sum_n
        m.d.comb += [
            add.a.eq(self.a), add.b.eq(self.b), add.sub.eq(0),
            mx.a.eq(self.a), mx.b.eq(self.b),
            self.o.eq(Mux(sum_d, add.o, mx_d)),
        ]
        return m



class RowReduce(wiring.Component):
    """Pipelined reduction tree over ``cols`` leaves.

    Parameters
    ----------
    cols : int
        Number of leaves (PE columns), a power of two >= 2.
    tag_width : int
        Width of the tag carried along with a reduction.
    node_factory : callable(level, index) -> (component or None, ports)
        Builds the node; the array passes a factory that returns an
        ``Instance`` of the shared node module for Verilog builds.  Default:
        an inline ``ReduceNode``.

    Ports
    -----
    leaves : In(ArrayLayout(32, cols))   the PEs' T values (cycle x)
    op : In(TreeOp)                      NONE / MAX / SUM, sampled in cycle x
    tag : In(tag_width)
    res : Out(32)                        result, valid in cycle x + LATENCY
    res_valid : Out(1)
    res_tag : Out(tag_width)
    res_valid_next, res_tag_next : Out(1), Out(tag_width)
        ``res_valid`` and ``res_tag`` of the next cycle (for consumers one
        register stage ahead of the tree)

    Attributes
    ----------
    LATENCY : int  ``tree_latency(cols)``
    """

    def __init__(self, cols: int, tag_width: int, node_factory=None):
        if cols < 2 or cols & (cols - 1):
            raise ValueError(f"cols must be a power of two >= 2, not {cols!r}")
        self.cols = cols
        self.LATENCY = tree_latency(cols)
        self._node_factory = node_factory
        super().__init__({
            "leaves": In(data.ArrayLayout(32, cols)), "op": In(TreeOp), "tag": In(tag_width),
            "res": Out(32), "res_valid": Out(1), "res_tag": Out(tag_width),
            "res_valid_next": Out(1), "res_tag_next": Out(tag_width),
        })

    def elaborate(self, platform):
        m = Module()
        level = [self.leaves[i] for i in range(self.cols)]
        is_sum = self.op == TreeOp.SUM
        valid = self.op != TreeOp.NONE
        tag = self.tag
        for lv in range(self.cols.bit_length() - 1):
            nxt = []
            for i in range(len(level) // 2):
                o = Signal(32, name=f"l{lv + 1}_{i}")
                if self._node_factory is None:
                    node = ReduceNode()
                    m.submodules[f"n{lv}_{i}"] = node
                    m.d.comb += [node.a.eq(level[2 * i]), node.b.eq(level[2 * i + 1]),
                                 node.sum.eq(is_sum)]
                    m.d.sync += o.eq(node.o)
                else:
                    oc = Signal(32, name=f"c{lv + 1}_{i}")
                    m.submodules[f"n{lv}_{i}"] = self._node_factory(level[2 * i], level[2 * i + 1],
                                                                     is_sum, oc)
                    m.d.sync += o.eq(oc)
                nxt.append(o)
            # The sum/max selection, valid and tag travel with the data, one
            # register per cycle, so reductions of different rows can overlap.
            for i in range(NODE_LATENCY + 1):
                valid_next, tag_next = valid, tag
                s_n = Signal(name=f"sum{lv + 1}_{i}")
                v_n = Signal(name=f"valid{lv + 1}_{i}")
                t_n = Signal.like(self.tag, name=f"tag{lv + 1}_{i}")
                m.d.sync += [s_n.eq(is_sum), v_n.eq(valid), t_n.eq(tag)]
                is_sum, valid, tag = s_n, v_n, t_n
            level = nxt
        m.d.comb += [self.res.eq(level[0]), self.res_valid.eq(valid), self.res_tag.eq(tag),
                     self.res_valid_next.eq(valid_next), self.res_tag_next.eq(tag_next)]
        return m
