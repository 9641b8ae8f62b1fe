"""Host memory and the copies over it: buffers that may be pinned or shared with another process (hostmem.py) and
the row copies every tier and transport makes (hostcopy.py: the native CPU library, else numpy)."""
