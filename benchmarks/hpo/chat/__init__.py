"""The short-answer chat task of the benchmark: short_answers.jsonl + reward.score."""
