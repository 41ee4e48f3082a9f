package deploycheck

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func imageRules(t *testing.T) ImageRules {
	return ImageRules{Context: root, Built: built(t), Targets: imageTargets}
}

// The image's Dockerfile: a Go build stage, a Debian runtime, one target
// per server whose ENTRYPOINT is that binary, copied from the build; every
// COPY source exists in the repository.
func TestDockerfile(t *testing.T) {
	f, err := os.Open(filepath.Join(root, "deploy/container/Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	stages, errs := imageRules(t).CheckDockerfile("Dockerfile", f)
	for _, err := range errs {
		t.Error(err)
	}
	want := map[string]string{"build": "golang:", "runtime": "debian:", "space-api": "runtime", "space-edge": "runtime", "space-node": "runtime"}
	got := map[string]string{}
	for _, st := range stages {
		got[st.Name] = st.From
	}
	for name, from := range want {
		if g, ok := got[name]; !ok || len(g) < len(from) || g[:len(from)] != from {
			t.Errorf("stage %s FROM %q, want %s...", name, g, from)
		}
	}
	// The build stage builds every binary the node target copies.
	var build string
	for _, st := range stages {
		if st.Name == "build" {
			for _, in := range st.Instructions {
				if in.Keyword == "RUN" {
					build += in.Args
				}
			}
		}
	}
	for b := range built(t) {
		if !contains(strings.Fields(build), "./cmd/"+b) {
			t.Errorf("the build stage does not build %s", b)
		}
	}
}

// A Dockerfile with each mistake is rejected for each.
func TestDockerfileRejects(t *testing.T) {
	f, err := os.Open("testdata/dockerfile-broken/Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	_, errs := imageRules(t).CheckDockerfile("Dockerfile", f)
	wantErrs(t, "broken Dockerfile", errs,
		`FROM golang: neither an earlier stage nor a pinned image`,
		`COPY source no-such-file does not exist`,
		`COPY source internal/\*.go: use plain paths`,
		`COPY --from=builder names no earlier stage`,
		`target space-api: ENTRYPOINT /usr/local/bin/space-api is not copied`,
		`ENTRYPOINT in shell form`,
		`target space-node: ENTRYPOINT runs /usr/bin/python3`,
		`stage extra is defined twice`,
	)
}
