"""flashnpu.hdl."""
