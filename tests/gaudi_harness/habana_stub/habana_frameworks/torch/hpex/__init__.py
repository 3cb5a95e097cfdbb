"""habana_frameworks.torch.hpex: only `normalization` (the fused RMSNorm vllm-gaudi's HPURMSNorm calls)."""
