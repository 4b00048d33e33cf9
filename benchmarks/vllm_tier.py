"""The vLLM tier against vLLM's own fs tier (or its store called directly). See
kvtier/bench/vllm_tier.py."""

from kvtier.bench.vllm_tier import main

if __name__ == "__main__":
    main()
