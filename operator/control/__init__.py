"""The operator's edge: the kopf handlers (:mod:`.handlers`), the Kubernetes client (:mod:`.kube`), the children it
applies and reads (:mod:`.children`), the status writes (:mod:`.observer`), what it remembers per object
(:mod:`.tracking`), its own metrics (:mod:`.metrics`) and the API calls it is granted (:mod:`.rbac`). Everything
that decides is a pure function in :mod:`kubellm.operator.render` or :mod:`kubellm.operator.status`."""
