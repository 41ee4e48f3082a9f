package deploycheck

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// Object is one decoded Kubernetes document.
type Object struct {
	// Source is file#index, for messages.
	Source string
	Kind   string
	Meta   metav1.ObjectMeta
	// Obj is the typed object (*appsv1.Deployment, *corev1.Service, ...).
	Obj any
}

// kinds are the documents a SPACE manifest may hold, with their
// apiVersion and a constructor of the official type.
var kinds = map[string]struct {
	apiVersion string
	new        func() any
}{
	"Namespace":             {"v1", func() any { return &corev1.Namespace{} }},
	"Service":               {"v1", func() any { return &corev1.Service{} }},
	"Secret":                {"v1", func() any { return &corev1.Secret{} }},
	"ConfigMap":             {"v1", func() any { return &corev1.ConfigMap{} }},
	"ServiceAccount":        {"v1", func() any { return &corev1.ServiceAccount{} }},
	"PersistentVolumeClaim": {"v1", func() any { return &corev1.PersistentVolumeClaim{} }},
	"Deployment":            {"apps/v1", func() any { return &appsv1.Deployment{} }},
	"StatefulSet":           {"apps/v1", func() any { return &appsv1.StatefulSet{} }},
	"DaemonSet":             {"apps/v1", func() any { return &appsv1.DaemonSet{} }},
	"PodDisruptionBudget":   {"policy/v1", func() any { return &policyv1.PodDisruptionBudget{} }},
}

// DecodeManifests reads every YAML document of r (named name) strictly:
// an unknown or duplicated field, a wrong apiVersion or an unknown kind
// is an error.
func DecodeManifests(name string, r io.Reader) ([]Object, error) {
	var out []Object
	yr := utilyaml.NewYAMLReader(bufio.NewReader(r))
	for i := 0; ; i++ {
		doc, err := yr.Read()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		if len(bytes.TrimSpace(stripComments(doc))) == 0 {
			continue
		}
		src := fmt.Sprintf("%s#%d", name, i)
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal(doc, &tm); err != nil {
			return nil, fmt.Errorf("%s: %w", src, err)
		}
		k, ok := kinds[tm.Kind]
		if !ok {
			return nil, fmt.Errorf("%s: kind %q is not one SPACE's manifests use", src, tm.Kind)
		}
		if tm.APIVersion != k.apiVersion {
			return nil, fmt.Errorf("%s: %s wants apiVersion %s, has %q", src, tm.Kind, k.apiVersion, tm.APIVersion)
		}
		obj := k.new()
		if err := yaml.UnmarshalStrict(doc, obj); err != nil {
			return nil, fmt.Errorf("%s (%s): %w", src, tm.Kind, err)
		}
		meta, err := objectMeta(obj)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", src, err)
		}
		if meta.Name == "" {
			return nil, fmt.Errorf("%s: %s without metadata.name", src, tm.Kind)
		}
		out = append(out, Object{Source: src, Kind: tm.Kind, Meta: meta, Obj: obj})
	}
}

func stripComments(doc []byte) []byte {
	var b bytes.Buffer
	for _, l := range strings.Split(string(doc), "\n") {
		if t := strings.TrimSpace(l); t != "" && !strings.HasPrefix(t, "#") {
			b.WriteString(l)
			b.WriteByte('\n')
		}
	}
	return b.Bytes()
}

func objectMeta(obj any) (metav1.ObjectMeta, error) {
	if o, ok := obj.(metav1.Object); ok {
		return metav1.ObjectMeta{Name: o.GetName(), Namespace: o.GetNamespace(), Labels: o.GetLabels()}, nil
	}
	return metav1.ObjectMeta{}, fmt.Errorf("%T has no object metadata", obj)
}

// Workload is a pod template with the selector that owns it.
type Workload struct {
	Object
	Selector *metav1.LabelSelector
	Template corev1.PodTemplateSpec
	// Claims are a StatefulSet's volumeClaimTemplates, volumes of its pods.
	Claims []string
}

// Workloads returns the Deployments, StatefulSets and DaemonSets of objs.
func Workloads(objs []Object) []Workload {
	var out []Workload
	for _, o := range objs {
		switch w := o.Obj.(type) {
		case *appsv1.Deployment:
			out = append(out, Workload{o, w.Spec.Selector, w.Spec.Template, nil})
		case *appsv1.StatefulSet:
			var claims []string
			for _, c := range w.Spec.VolumeClaimTemplates {
				claims = append(claims, c.Name)
			}
			out = append(out, Workload{o, w.Spec.Selector, w.Spec.Template, claims})
		case *appsv1.DaemonSet:
			out = append(out, Workload{o, w.Spec.Selector, w.Spec.Template, nil})
		}
	}
	return out
}

// Kustomization is the part of a kustomization.yaml SPACE uses.
type Kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Resources  []string `json:"resources"`
	Images     []struct {
		Name    string `json:"name"`
		NewName string `json:"newName,omitempty"`
		NewTag  string `json:"newTag,omitempty"`
	} `json:"images"`
}

// DecodeKustomization reads a kustomization.yaml strictly (unknown
// fields are errors: this is the subset SPACE's uses).
func DecodeKustomization(data []byte) (*Kustomization, error) {
	var k Kustomization
	if err := yaml.UnmarshalStrict(data, &k); err != nil {
		return nil, fmt.Errorf("kustomization.yaml: %w", err)
	}
	if k.APIVersion != "kustomize.config.k8s.io/v1beta1" || k.Kind != "Kustomization" {
		return nil, fmt.Errorf("kustomization.yaml: apiVersion/kind %s/%s", k.APIVersion, k.Kind)
	}
	return &k, nil
}
