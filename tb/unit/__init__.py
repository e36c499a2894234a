"""flashnpu.tb.unit."""
