"""The serving process (`tierstore serve`): its config, the tables it serves
(served), the gRPC service and process (server), the local step socket
(step_server, served_steps), auth, listeners, metrics, trace recording, and
SidecarProcess (launcher), which starts one as a child.
"""
