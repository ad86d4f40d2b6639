"""Estimates before spending compute. Nothing here allocates model memory."""
