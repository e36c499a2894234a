"""flashnpu.sim."""
