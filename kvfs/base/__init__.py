"""The ground floor: small helpers that every layer may import, and that import no layer.

``aligned``      sector alignment and aligned buffers
``crashpoints``  named points where the crash tests stop the process
``gcpolicy``     when the garbage collector may run (not during loads and checkpoints)
``gilpolicy``    letting the event loop run first during long CPU work in threads
``nested``       nesting-aware on/off sections, for the two policies above
``sharedints``   one int object per distinct value, for millions of rows
"""
