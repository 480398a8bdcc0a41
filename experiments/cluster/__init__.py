"""Running sites as processes on one machine: rate-limited links between network namespaces (`links`, over
`netns` and `process`) and the launcher's supervisor (`supervisor`). The commands are `python -m experiments.links`
and `python -m experiments.launch`."""
