"""Helpers the experiment scripts share (the only experiments modules a script may import)."""
