"""The serving process (`tierstore serve`): its config, the tables it serves
(served, composed of builder, versions, reaper, prefetcher, learner and
warm_start), start-up as a transaction (startup), the gRPC service and process
(server), the local step socket (step_server, served_steps), auth, listeners,
metrics, trace recording, and SidecarProcess (launcher), which starts one as a
child.
"""
