package node

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/baseimage"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate/ns"
)

func TestBaseImageConfig(t *testing.T) {
	if err := (Config{DataDir: "/d", SnapshotDir: "/s", BaseImage: "maybe"}).Validate(); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("unknown base image mode: %v", err)
	}
	if d := (Config{}).withDefaults(); d.BaseImage != BaseImageAuto {
		t.Fatalf("default base image mode %q", d.BaseImage)
	}
}

// TestBaseImages: base gets the Debian image only when it is there (auto
// never builds), off never; a fallback says why.
func TestBaseImages(t *testing.T) {
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	if im := baseImages(Config{BaseImage: BaseImageOff, Logger: log}); im != nil {
		t.Fatalf("off: %v", im)
	}
	if im := baseImages(Config{BaseImage: BaseImageAuto, BaseImageCache: t.TempDir(), Logger: log}); im != nil {
		t.Fatalf("auto on an empty cache: %v", im)
	}
	if !strings.Contains(logs.String(), "run on the host's /usr") || !strings.Contains(logs.String(), "make base-image") {
		t.Fatalf("the fallback does not say why:\n%s", logs.String())
	}
	b, err := baseimage.Lookup(baseimage.Config{})
	if err != nil {
		t.Logf("the Debian base image is not built; its use is not checked: %v", err)
		return
	}
	im := baseImages(Config{BaseImage: BaseImageAuto, Logger: log})
	if got := im[ns.TemplateBase]; got.ID != b.ID || len(got.Layers) != 1 || got.Layers[0] != b.Dir {
		t.Fatalf("base: %+v, want %s", got, b.Dir)
	}
}
