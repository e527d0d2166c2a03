"""cuda-samples verification: build.py builds NVIDIA's samples, run.py runs them locally and through rgpu."""
