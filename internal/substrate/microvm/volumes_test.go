package microvm

import (
	"context"
	"errors"
	"testing"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate"
)

// A microVM refuses volumes before it starts anything, with an error a
// client reads as a bad request.
func TestStartRefusesVolumes(t *testing.T) {
	var s Substrate
	_, err := s.Start(context.Background(), substrate.Spec{Volumes: []substrate.VolumeMount{{Name: "v", Source: "/x", Path: "/mnt/v"}}})
	if !errors.Is(err, ErrVolumes) || !errors.Is(err, errdefs.ErrInvalid) || err.Error() != "volumes are not supported on the microvm substrate" {
		t.Fatalf("Start with volumes: %v", err)
	}
}
