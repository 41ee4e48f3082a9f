package microvm

import "github.com/spacesbx/space/internal/errdefs"

// ErrVolumes refuses Spec.Volumes: a microVM has no host directory shared
// into it (no virtio-fs or 9p device; its files live in guest memory).
var ErrVolumes = errdefs.Message(errdefs.ErrInvalid, "volumes are not supported on the microvm substrate")
