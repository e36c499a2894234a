"""flashnpu.scripts."""
