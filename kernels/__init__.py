"""kubellm kernels: native C++ kernels for CPU (``csrc/``, built by ``cpu_extension``) and Triton kernels for
CUDA, each beside a plain-PyTorch reference of the same contract, and the Triton start-up checks."""
