"""Diagnostics run on request (tests, the doctor), never by ComfyUI's start-up."""
