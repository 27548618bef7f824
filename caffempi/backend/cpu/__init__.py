"""The NumPy kernels: what the CPU runs fast (convolution, pooling, the
large products, LRN's window sums, dropout masks), each function the CPU
side of a name :mod:`caffempi.backend.kernels` dispatches.

NCHW arrays; ``geom`` is the 2-D window geometry ``(kh, kw, sh, sw, ph, pw,
dh, dw)``: kernel, stride, pad and dilation.  The kernels work in chunks of
images that fit in cache (:mod:`.chunking`) on the intra-op threads
(:mod:`caffempi.backend.threads`), BLAS at one thread, with scratch buffers
that persist between calls (:mod:`.scratch`):

* :mod:`.conv`: convolution, each direction by a table of algorithms;
* :mod:`.gemm`: products split over the threads;
* :mod:`.pool`: MAX pooling by the compiled kernels of
  :mod:`caffempi.backend.pooling`, one NumPy fallback; AVE pooling;
* :mod:`.blocks`: elementwise and per-channel passes in blocks;
* :mod:`.lrn`, :mod:`.dropout`.

Why each kernel is as it is, with the measurements and what was tried and
not kept: docs/design/cpu.md.
"""
from .blocks import for_channel_blocks, for_element_blocks
from .chunking import images_per_chunk, over_images
from .conv import bias_grad, col2im, conv2d_backward, conv2d_forward, conv_out_size, im2col, is_pointwise
from .dropout import dropout_mask, dropout_scale
from .gemm import matmul, matmul_into
from .lrn import channel_window_sum, spatial_window_sum
from .pool import ave_pool_backward, ave_pool_forward, max_pool_backward, max_pool_forward

__all__ = ["ave_pool_backward", "ave_pool_forward", "bias_grad", "channel_window_sum", "col2im",
           "conv2d_backward", "conv2d_forward", "conv_out_size", "dropout_mask", "dropout_scale",
           "for_channel_blocks", "for_element_blocks", "im2col", "images_per_chunk", "is_pointwise",
           "matmul", "matmul_into", "max_pool_backward", "max_pool_forward", "over_images",
           "spatial_window_sum"]
