package node

import (
	"bytes"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"testing"

	"github.com/spacesbx/space/internal/baseimage"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate/ns"
	"github.com/spacesbx/space/internal/testenv"
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

// TestCodeInterpreterImages: code-interpreter-v1 (ns) and its VM variant
// get the code interpreter stack when it is built; without it, none, and
// the log says why.
func TestCodeInterpreterImages(t *testing.T) {
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	if _, err := baseimage.Lookup(baseimage.Config{}); err != nil {
		testenv.Skipf(t, "the Debian base image is not built (make base-image): %v", err)
	}
	im := baseImages(Config{BaseImage: BaseImageAuto, Logger: log})
	st, err := baseimage.LookupInterp(baseimage.InterpConfig{})
	if err != nil {
		if _, ok := im[TemplateCodeInterpreter]; ok || !strings.Contains(logs.String(), "code interpreter template: its image is unavailable") {
			t.Fatalf("without the image: %v\n%s", im, logs.String())
		}
		testenv.Skipf(t, "the code interpreter image is not built (make build): %v", err)
	}
	got := im[TemplateCodeInterpreter]
	if got.ID != st.ID || !slices.Equal(got.Layers, st.Layers) || len(got.Layers) != 2 || got.Layers[0] != im[ns.TemplateBase].Layers[0] {
		t.Fatalf("%s: %+v, want %+v over the base", TemplateCodeInterpreter, got, st)
	}
	vm := vmImages(im)
	if vm[VMTemplateCodeInterpreter].ID != st.ID || vm[VMTemplateBase].ID != im[ns.TemplateBase].ID {
		t.Fatalf("vm images: %+v", vm)
	}
}
