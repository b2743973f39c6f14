"""Launchers: what runs on a node (the torch elastic agent) and in each rank."""
