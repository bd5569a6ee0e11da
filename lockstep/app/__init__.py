"""The application: the command line and what its commands run (the demo, the evaluation, the load run,
the offline diagnosis, an operator's requests, the child processes), on top of the pipeline's stages."""
