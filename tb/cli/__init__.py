"""flashnpu.tb.cli."""
