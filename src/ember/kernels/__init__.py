"""Optional compiled kernels; the model falls back to plain torch ops without them."""
