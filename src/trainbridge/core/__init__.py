"""The core: config, the event map, control and its agreement, the context callbacks see, the callback
base class and manager, and the distributed seam.  Nothing here imports another trainbridge layer."""
