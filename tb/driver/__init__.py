"""flashnpu.tb.driver."""
