"""Paper and real-model reproductions: experiments/repro/X.py writes experiments/results/X.json."""
