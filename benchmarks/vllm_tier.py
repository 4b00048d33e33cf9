"""The vLLM tier against its store called directly. See kvtier/bench/vllm_tier.py."""

from kvtier.bench.vllm_tier import main

if __name__ == "__main__":
    main()
