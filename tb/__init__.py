"""flashnpu.tb."""
