"""Triton kernels for DeepSeek-V4-Flash's hot paths, one module per family, each with its launcher and a
plain-torch reference the tests compare against: q8_0, iq2_xxs, q2_k (repack + decode matvec; Q8_0 also the
prefill matmul), moe (fused routed experts, decode), moe_prefill (tokens grouped by expert), act_quant (int8
activations for the integer-dot kernels), norm (RMSNorm, partial RoPE). dispatch holds every tile / warp
choice per backend; ops is the entry point the engine calls (Triton on a GPU tensor, torch on CPU);
benchmark and compile_check back `ds4station bench kernels` / `bench compile`. See docs/PERFORMANCE.md.
"""
