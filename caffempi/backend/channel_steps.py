"""The variants of BatchNorm's and Scale's per-channel passes, named once
for the CPU's kernels (backend/channels.py) and the GPU's
(backend/gpu_channels.py)."""

# statistics: none (Scale's backward alone), the batch's (computed), given (read)
NO_STATS, BATCH_STATS, GIVEN_STATS = 0, 1, 2
# affine: none, scale, scale and bias
NO_AFFINE, SCALE, SCALE_BIAS = 0, 1, 2
