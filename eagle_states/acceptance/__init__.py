"""What a dataset is for, measured: an EAGLE-3 draft trained on it with speculators, served by vLLM beside drafts
trained on deliberately wrong states (`harness.run_acceptance`, `eagle-states acceptance`)."""
