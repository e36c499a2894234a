"""flashnpu.tb.model."""
