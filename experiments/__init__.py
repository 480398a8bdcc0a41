"""The composition root and its commands: the config's schema (schema.py) and the builders from it (build.py), the
commands (run, serve, launch, links, tokenizer, hf), configs/, the Hugging Face mapping (hf/), the HTTP server
(server/), the cluster tools (cluster/), benchmarks (bench/) and paper reproductions (reproduce/)."""
