"""Measuring: what each stage costs (``profile``), and choosing programs by timing them (``tune``)."""
