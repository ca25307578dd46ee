"""Observation: calibration rows through the model one decoder layer at a time.

run.observe (orchestration, resumable) · streaming.stream_final_hidden (the layer-streamed forward) ·
layer_loader (source tensors -> a transformers decoder layer, by arch.module_map's plan) ·
routing (GLM's exact routing) · capture (hooks) · stats (REAP) · hessians / hessian_reader (expert Hessians) ·
prune (keep top-N) · report (tables, heat map). On-disk format: docs/observations.md.
"""
