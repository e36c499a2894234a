"""flashnpu.tb.rtl."""
