package deploycheck

import (
	"fmt"
	"net"
	"path"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// KubeRules are what SPACE's manifests are checked against.
type KubeRules struct {
	// Namespace every namespaced object is in (and a Namespace names).
	Namespace string
	// Flags are each binary's flags (HelpFlags).
	Flags map[string]FlagSet
	// Secret names flags that never go on a command line.
	Secret []string
	// Images maps an image's repository name (without registry and tag)
	// to the binary its ENTRYPOINT runs (the Dockerfile's targets).
	Images map[string]string
	// Health maps a binary to the path its health check answers on its
	// main listener.
	Health map[string]string
	// PortFlags maps a container port's name to the flag that makes the
	// binary listen there (http: addr, metrics: metrics-addr, ...).
	PortFlags map[string]string
	// Privileged names the binaries that run privileged (space-node);
	// every other SPACE container runs as a non-root user.
	Privileged map[string]bool
}

type kubeChecker struct {
	KubeRules
	objs []Object
	errs []error
}

func (c *kubeChecker) bad(src, format string, a ...any) {
	c.errs = append(c.errs, fmt.Errorf("%s: %s", src, fmt.Sprintf(format, a...)))
}

// Check returns what is wrong with the documents objs (every file of a
// deployment, read by DecodeManifests).
func (r KubeRules) Check(objs []Object) []error {
	c := &kubeChecker{KubeRules: r, objs: objs}
	seen := map[string]string{}
	nsFound := false
	for _, o := range objs {
		key := o.Kind + "/" + o.Meta.Name
		if prev, dup := seen[key]; dup {
			c.bad(o.Source, "%s is also defined at %s", key, prev)
		}
		seen[key] = o.Source
		if o.Kind == "Namespace" {
			nsFound = nsFound || o.Meta.Name == r.Namespace
			continue
		}
		if o.Meta.Namespace != r.Namespace {
			c.bad(o.Source, "%s is in namespace %q, want %q", key, o.Meta.Namespace, r.Namespace)
		}
		if s, ok := o.Obj.(*corev1.Secret); ok {
			for k, v := range s.Data {
				if len(v) > 0 {
					c.bad(o.Source, "Secret %s embeds a value for %s: secrets are made by the operator, not shipped", o.Meta.Name, k)
				}
			}
			for k, v := range s.StringData {
				if v != "" {
					c.bad(o.Source, "Secret %s embeds a value for %s: secrets are made by the operator, not shipped", o.Meta.Name, k)
				}
			}
		}
	}
	if !nsFound {
		c.errs = append(c.errs, fmt.Errorf("no Namespace %q", r.Namespace))
	}
	tags := map[string]string{}
	for _, w := range Workloads(objs) {
		c.workload(w, tags)
	}
	for _, o := range objs {
		switch x := o.Obj.(type) {
		case *corev1.Service:
			c.service(o, x)
		case *appsv1.StatefulSet:
			if svc := c.find("Service", x.Spec.ServiceName); svc == nil {
				c.bad(o.Source, "StatefulSet %s: serviceName %q names no Service", o.Meta.Name, x.Spec.ServiceName)
			} else if svc.Obj.(*corev1.Service).Spec.ClusterIP != corev1.ClusterIPNone {
				c.bad(o.Source, "StatefulSet %s: Service %s is not headless (clusterIP: None)", o.Meta.Name, x.Spec.ServiceName)
			}
		case *policyv1.PodDisruptionBudget:
			if x.Spec.Selector == nil || len(c.selected(x.Spec.Selector.MatchLabels)) == 0 {
				c.bad(o.Source, "PodDisruptionBudget %s selects no workload's pods", o.Meta.Name)
			}
		}
	}
	distinct := map[string]bool{}
	for _, tg := range tags {
		distinct[tg] = true
	}
	if len(distinct) > 1 {
		c.errs = append(c.errs, fmt.Errorf("SPACE images carry different tags %v: one release runs together", tags))
	}
	return c.errs
}

func (c *kubeChecker) find(kind, name string) *Object {
	for i := range c.objs {
		if c.objs[i].Kind == kind && c.objs[i].Meta.Name == name {
			return &c.objs[i]
		}
	}
	return nil
}

// selected returns the workloads whose pods carry every label of sel.
func (c *kubeChecker) selected(sel map[string]string) []Workload {
	if len(sel) == 0 {
		return nil
	}
	var out []Workload
	for _, w := range Workloads(c.objs) {
		match := true
		for k, v := range sel {
			match = match && w.Template.Labels[k] == v
		}
		if match {
			out = append(out, w)
		}
	}
	return out
}

func (c *kubeChecker) workload(w Workload, tags map[string]string) {
	src := w.Source + " " + w.Kind + "/" + w.Meta.Name
	if w.Selector == nil || len(w.Selector.MatchLabels) == 0 {
		c.bad(src, "no selector.matchLabels")
	} else {
		for k, v := range w.Selector.MatchLabels {
			if w.Template.Labels[k] != v {
				c.bad(src, "selector %s=%s does not match the pod template's labels %v", k, v, w.Template.Labels)
			}
		}
	}
	spec := w.Template.Spec
	vols := map[string]bool{}
	for _, c := range w.Claims {
		vols[c] = true
	}
	for _, v := range spec.Volumes {
		vols[v.Name] = true
		switch {
		case v.Secret != nil:
			c.needSecret(src, v.Secret.SecretName, "")
		case v.PersistentVolumeClaim != nil:
			if c.find("PersistentVolumeClaim", v.PersistentVolumeClaim.ClaimName) == nil {
				c.bad(src, "volume %s: PersistentVolumeClaim %q is not defined", v.Name, v.PersistentVolumeClaim.ClaimName)
			}
		case v.ConfigMap != nil:
			if c.find("ConfigMap", v.ConfigMap.Name) == nil {
				c.bad(src, "volume %s: ConfigMap %q is not defined", v.Name, v.ConfigMap.Name)
			}
		}
	}
	if sa := spec.ServiceAccountName; sa != "" && c.find("ServiceAccount", sa) == nil {
		c.bad(src, "serviceAccountName %q is not defined", sa)
	}
	for _, ct := range append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...) {
		c.container(src+" container "+ct.Name, spec, ct, vols, tags)
	}
}

func (c *kubeChecker) needSecret(src, name, key string) {
	o := c.find("Secret", name)
	if o == nil {
		c.bad(src, "Secret %q is not declared (deploy/kubernetes/secrets.example.yaml lists what the operator creates)", name)
		return
	}
	if key == "" {
		return
	}
	s := o.Obj.(*corev1.Secret)
	_, inData := s.Data[key]
	_, inString := s.StringData[key]
	if !inData && !inString {
		c.bad(src, "Secret %s has no key %q", name, key)
	}
}

func (c *kubeChecker) container(src string, spec corev1.PodSpec, ct corev1.Container, vols map[string]bool, tags map[string]string) {
	for _, m := range ct.VolumeMounts {
		if !vols[m.Name] {
			c.bad(src, "volumeMount %s names no volume of the pod", m.Name)
		}
	}
	for _, e := range ct.Env {
		if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
			c.needSecret(src+" env "+e.Name, e.ValueFrom.SecretKeyRef.Name, e.ValueFrom.SecretKeyRef.Key)
		}
		if e.ValueFrom != nil && e.ValueFrom.ConfigMapKeyRef != nil && c.find("ConfigMap", e.ValueFrom.ConfigMapKeyRef.Name) == nil {
			c.bad(src, "env %s: ConfigMap %q is not defined", e.Name, e.ValueFrom.ConfigMapKeyRef.Name)
		}
	}
	for _, ef := range ct.EnvFrom {
		if ef.SecretRef != nil {
			c.needSecret(src+" envFrom", ef.SecretRef.Name, "")
		}
	}
	if ct.Resources.Requests.Cpu().IsZero() || ct.Resources.Requests.Memory().IsZero() {
		c.bad(src, "no cpu and memory requests")
	}
	repo, tag := splitImage(ct.Image)
	bin, ours := c.Images[repo]
	if !ours {
		return
	}
	tags[repo] = tag
	if len(ct.Command) > 0 && path.Base(ct.Command[0]) != bin {
		c.bad(src, "image %s runs %s, the command names %s", repo, bin, ct.Command[0])
	}
	args := ct.Args
	if len(ct.Command) > 1 {
		args = append(append([]string{}, ct.Command[1:]...), args...)
	}
	fs := c.Flags[bin]
	for _, e := range CheckArgs(fs, args, c.Secret...) {
		c.bad(src, "args: %v", e)
	}
	ports := map[string]int32{}
	for _, p := range ct.Ports {
		ports[p.Name] = p.ContainerPort
		flag, ok := c.PortFlags[p.Name]
		if !ok {
			continue
		}
		v, given := ArgValue(args, flag)
		if !given {
			if fs[flag].Default == "" {
				c.bad(src, "port %s: --%s is not given", p.Name, flag)
				continue
			}
			v = fs[flag].Default
		}
		host, port, err := net.SplitHostPort(v)
		if err != nil || port != fmt.Sprint(p.ContainerPort) {
			c.bad(src, "port %s (%d): --%s=%s listens elsewhere", p.Name, p.ContainerPort, flag, v)
		} else if host == "127.0.0.1" || host == "localhost" || host == "::1" {
			c.bad(src, "port %s: --%s=%s listens on the loopback only, unreachable from other pods and the kubelet", p.Name, flag, v)
		}
	}
	if ct.ReadinessProbe == nil || ct.LivenessProbe == nil {
		c.bad(src, "want a readiness and a liveness probe")
	}
	for what, pr := range map[string]*corev1.Probe{"readiness": ct.ReadinessProbe, "liveness": ct.LivenessProbe, "startup": ct.StartupProbe} {
		if pr == nil {
			continue
		}
		var port intstr.IntOrString
		switch {
		case pr.HTTPGet != nil:
			port = pr.HTTPGet.Port
			if p := pr.HTTPGet.Path; p != c.Health[bin] && p != "/metrics" {
				c.bad(src, "%s probe GET %s: %s answers health on %s", what, p, bin, c.Health[bin])
			}
			if pr.HTTPGet.Path == "/metrics" && port.String() != "metrics" {
				c.bad(src, "%s probe GET /metrics on port %s: /metrics is served on the metrics port", what, port.String())
			}
			if pr.HTTPGet.Path == c.Health[bin] && port.String() == "metrics" {
				c.bad(src, "%s probe GET %s on the metrics port: it is served on the main listener", what, pr.HTTPGet.Path)
			}
		case pr.TCPSocket != nil:
			port = pr.TCPSocket.Port
		default:
			c.bad(src, "%s probe: want httpGet or tcpSocket", what)
			continue
		}
		if !portIn(port, ports) {
			c.bad(src, "%s probe port %s is not a container port", what, port.String())
		}
	}
	sc := ct.SecurityContext
	if c.Privileged[bin] {
		if sc == nil || sc.Privileged == nil || !*sc.Privileged {
			c.bad(src, "%s needs privileged: true (namespaces, cgroups, mounts)", bin)
		}
		if !spec.HostPID {
			c.bad(src, "%s needs hostPID: sandboxes outlive the container and are adopted again by pid", bin)
		}
	} else if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || (sc.Privileged != nil && *sc.Privileged) {
		c.bad(src, "%s runs unprivileged: want runAsNonRoot: true, allowPrivilegeEscalation: false", bin)
	}
}

func portIn(p intstr.IntOrString, ports map[string]int32) bool {
	if p.Type == intstr.String {
		_, ok := ports[p.StrVal]
		return ok
	}
	for _, n := range ports {
		if n == p.IntVal {
			return true
		}
	}
	return false
}

// splitImage returns an image reference's repository name (its last path
// element) and tag.
func splitImage(ref string) (repo, tag string) {
	ref, _, _ = strings.Cut(ref, "@")
	name := ref
	if i := strings.LastIndexByte(ref, ':'); i > strings.LastIndexByte(ref, '/') {
		name, tag = ref[:i], ref[i+1:]
	}
	return path.Base(name), tag
}

func (c *kubeChecker) service(o Object, s *corev1.Service) {
	src := o.Source + " Service/" + o.Meta.Name
	ws := c.selected(s.Spec.Selector)
	if len(ws) == 0 {
		c.bad(src, "selector %v matches no workload's pods", s.Spec.Selector)
		return
	}
	for _, sp := range s.Spec.Ports {
		tp := sp.TargetPort
		if tp.Type == intstr.Int && tp.IntVal == 0 {
			tp = intstr.FromInt32(sp.Port)
		}
		for _, w := range ws {
			found := false
			for _, ct := range w.Template.Spec.Containers {
				ports := map[string]int32{}
				for _, p := range ct.Ports {
					ports[p.Name] = p.ContainerPort
				}
				found = found || portIn(tp, ports)
			}
			if !found {
				c.bad(src, "port %s: targetPort %s is not a container port of %s", sp.Name, tp.String(), w.Meta.Name)
			}
		}
	}
}
