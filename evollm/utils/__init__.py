"""The lowest room: crash-safe writes (checkpoint folders with manifests, single files, cache folders)
and the JSON form of recorded values. Imports nothing from the rest of evollm."""
