"""In-loop and after-training evaluation: multiple-choice benchmarks and held-out text sets
(tasks.py), scored on the trainer's model (score.py), with regression detection
(regression.py) tied back to the data trained on in between (window.py). The trainer runs
them through its `evals` component (training/components/evals.py); `ballast eval` runs the
same code on a checkpoint."""
