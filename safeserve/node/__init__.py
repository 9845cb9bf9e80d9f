"""The node agent (`safeserve node`): runs the ranks the frontend places on this machine."""
