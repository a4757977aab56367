"""C++ kernels for the CPU: the integer matmuls of a step (int_step.cpp) and the paged
attention (paged_attention.cpp), built into one library by library.py."""
