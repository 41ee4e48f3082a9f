package deploycheck

import (
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/spacesbx/space/api/spacev1"
	appsv1 "k8s.io/api/apps/v1"
)

// imageTargets are the Dockerfile's targets: image name -> binary its
// ENTRYPOINT runs (TestDockerfile checks the Dockerfile says so).
var imageTargets = map[string]string{"space-api": "space-api", "space-edge": "space-edge", "space-node": "space-node"}

func kubeRules(t *testing.T) KubeRules {
	return KubeRules{
		Namespace: "space",
		Flags:     binFlags(t),
		Secret:    secretFlags,
		Images:    imageTargets,
		// What each binary answers health on (TestHealthEndpoints runs
		// space-api and space-edge and asks them).
		Health:     map[string]string{"space-api": "/health", "space-edge": "/healthz", "space-node": spacev1.NodePathHealth},
		PortFlags:  map[string]string{"http": "addr", "https": "tls-addr", "metrics": "metrics-addr", "node-api": "addr"},
		Privileged: map[string]bool{"space-node": true},
	}
}

func decodeFile(t *testing.T, path string) ([]Object, error) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	return DecodeManifests(filepath.Base(path), f)
}

// manifests returns every document kustomization.yaml applies plus the
// Secrets the operator creates (secrets.example.yaml).
func manifests(t *testing.T) ([]Object, *Kustomization) {
	t.Helper()
	dir := filepath.Join(root, "deploy/kubernetes")
	data, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	k, err := DecodeKustomization(data)
	if err != nil {
		t.Fatal(err)
	}
	var objs []Object
	for _, r := range append(k.Resources, "secrets.example.yaml") {
		o, err := decodeFile(t, filepath.Join(dir, r))
		if err != nil {
			t.Fatal(err)
		}
		objs = append(objs, o...)
	}
	return objs, k
}

// Every manifest decodes strictly into the official types and passes the
// semantic checks; the kustomization covers every file and image.
func TestKubernetesManifests(t *testing.T) {
	objs, k := manifests(t)
	for _, err := range kubeRules(t).Check(objs) {
		t.Error(err)
	}
	kinds := map[string]int{}
	for _, o := range objs {
		kinds[o.Kind+"/"+o.Meta.Name]++
	}
	for _, want := range []string{"Namespace/space", "StatefulSet/etcd", "Deployment/space-api", "Service/space-api", "Deployment/space-edge", "Service/space-edge", "DaemonSet/space-node", "PersistentVolumeClaim/space-snapshots", "Secret/space-keys"} {
		if kinds[want] != 1 {
			t.Errorf("%s: %d documents", want, kinds[want])
		}
	}
	// Several replicas of each server, three etcd members.
	for name, want := range map[string]int32{"Deployment/space-api": 2, "Deployment/space-edge": 2, "StatefulSet/etcd": 3} {
		for _, o := range objs {
			if o.Kind+"/"+o.Meta.Name != name {
				continue
			}
			var got *int32
			switch x := o.Obj.(type) {
			case *appsv1.Deployment:
				got = x.Spec.Replicas
			case *appsv1.StatefulSet:
				got = x.Spec.Replicas
			}
			if got == nil || *got < want {
				t.Errorf("%s: replicas %v, want at least %d", name, got, want)
			}
		}
	}
	// Every YAML file of the directory is either applied or the Secrets'
	// example; the kustomization names all three images with one tag.
	files, _ := filepath.Glob(filepath.Join(root, "deploy/kubernetes/*.yaml"))
	listed := map[string]bool{"kustomization.yaml": true, "secrets.example.yaml": true}
	for _, r := range k.Resources {
		listed[r] = true
	}
	for _, f := range files {
		if !listed[filepath.Base(f)] {
			t.Errorf("%s is not in kustomization.yaml", filepath.Base(f))
		}
	}
	var names, tags []string
	for _, im := range k.Images {
		names = append(names, im.Name)
		tags = append(tags, im.NewTag)
		if !strings.HasSuffix(im.NewName, "/"+im.Name) {
			t.Errorf("kustomization image %s renamed to %s: keep the repository name", im.Name, im.NewName)
		}
	}
	sort.Strings(names)
	if strings.Join(names, ",") != "space-api,space-edge,space-node" {
		t.Errorf("kustomization images %v", names)
	}
	for _, tg := range tags {
		if tg != tags[0] {
			t.Errorf("kustomization tags differ: %v", tags)
		}
	}
}

// Each broken manifest in testdata, put in place of the real documents it
// names, is rejected for what is wrong with it.
func TestKubernetesRejects(t *testing.T) {
	r := kubeRules(t)
	for name, want := range map[string][]string{
		"unknown-field.yaml":     {`unknown field "replica"`},
		"wrong-apiversion.yaml":  {`Deployment wants apiVersion apps/v1`},
		"duplicate-field.yaml":   {`duplicate|already set`},
		"selector-mismatch.yaml": {`selector app.kubernetes.io/name=space-api does not match`, `Service/space-api: selector .* matches no workload`},
		"bad-ports.yaml":         {`targetPort htps is not a container port`, `targetPort 8080 is not a container port`, `Service space-edge is not headless`},
		"bad-args.yaml":          {`--leader-elect is not defined`, `--api-key carries a secret`, `port http \(3000\): --addr=0.0.0.0:3999 listens elsewhere`, `--metrics-addr=127.0.0.1:3090 listens on the loopback`},
		"bad-secret.yaml":        {`Secret space-keys has no key "EDGE_KEY"`, `Secret "edge-certs" is not declared`, `Secret space-keys embeds a value for SPACE_API_KEY`},
		"bad-probes.yaml":        {`readiness probe GET /health: space-edge answers health on /healthz`, `liveness probe port 9999 is not a container port`},
		"bad-images.yaml":        {`image space-edge runs space-edge, the command names /usr/local/bin/space-api`, `different tags`, `no cpu and memory requests`},
		"unprivileged-node.yaml": {`space-node needs privileged`, `needs hostPID`, `namespace "default"`, `PersistentVolumeClaim "snapshots" is not defined`, `volumeMount missing names no volume`},
	} {
		broken, err := decodeFile(t, filepath.Join("testdata/kubernetes-broken", name))
		if err != nil {
			wantErrs(t, name, []error{err}, want...)
			continue
		}
		objs, _ := manifests(t)
		for _, b := range broken {
			replaced := false
			for i := range objs {
				if objs[i].Kind == b.Kind && objs[i].Meta.Name == b.Meta.Name {
					objs[i], replaced = b, true
				}
			}
			if !replaced {
				objs = append(objs, b)
			}
		}
		wantErrs(t, name, r.Check(objs), want...)
	}
	// Documents that are not SPACE's kinds, and a workload of a kind the
	// checker does not know, are refused at decoding.
	for _, bad := range []string{"apiVersion: v1\nkind: Pod\nmetadata: {name: x}\n", "kind: Service\nmetadata: {name: x}\n", "apiVersion: v1\nkind: Service\nmetadata: {namespace: space}\n"} {
		if _, err := DecodeManifests("bad", strings.NewReader(bad)); err == nil {
			t.Errorf("%q decoded", bad)
		}
	}
	if _, err := DecodeKustomization([]byte("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresource: [a.yaml]\n")); err == nil {
		t.Error("kustomization with an unknown field decoded")
	}
}

// The unit tier's part (no binaries): every manifest decodes strictly, and
// the documents the decoder must refuse are refused.
func TestKubernetesDecodes(t *testing.T) {
	objs, _ := manifests(t)
	if len(objs) < 10 {
		t.Errorf("%d documents", len(objs))
	}
	for name, want := range map[string]string{
		"unknown-field.yaml":    `unknown field "replica"`,
		"wrong-apiversion.yaml": `Deployment wants apiVersion apps/v1`,
		"duplicate-field.yaml":  `duplicate|already set`,
	} {
		_, err := decodeFile(t, filepath.Join("testdata/kubernetes-broken", name))
		if err == nil {
			t.Errorf("%s decoded", name)
			continue
		}
		wantErrs(t, name, []error{err}, want)
	}
}
