"""What a message carries beside text: pictures and sound clips, the projector (mmproj) that
encodes them, its cache and the plan that borrows the accelerator for it."""
