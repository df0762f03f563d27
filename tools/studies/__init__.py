"""One-off studies whose results a doc cites; kept to reproduce them."""
