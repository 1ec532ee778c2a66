"""Reads step-wise training samples from the gateway store."""
