"""flashnpu.tb: the test suite, grouped by kind (unit, rtl, model, driver, cli)."""
