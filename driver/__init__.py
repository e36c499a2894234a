"""flashnpu.driver."""
