"""kubellm kernels: Triton kernels, each beside a plain-PyTorch reference."""
