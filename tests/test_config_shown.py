"""`tierctl config` masks secrets and nothing else: numbers named after tokens are settings."""

from kvtier.config import explain, load_config
from kvtier.secrets import shown


def test_token_counts_are_shown_and_secrets_masked():
    cfg = load_config(
        None,
        {
            "controller": {
                "prefetch_timeout_per_1k_tokens_s": 0.25,
                "prefetch_min_tokens": 64,
                "load_back_min_tokens": 32,
            }
        },
        env={},
    )
    text = explain(cfg)
    assert "controller.prefetch_timeout_per_1k_tokens_s = 0.25" in text
    assert "controller.prefetch_min_tokens = 64" in text
    assert "controller.load_back_min_tokens = 32" in text
    assert "***" not in text
    for field in (
        "password",
        "aws_secret_access_key",
        "aws_session_token",
        "token",
        "api_key",
        "Secret",
    ):
        assert shown(field, "hunter2") == "***", field
    assert shown("url", "redis://u:pw@host:6379/0") == "redis://u:***@host:6379/0"
