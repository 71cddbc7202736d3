-- Argo CD health of a kubellm.io LLMDeployment, from the status the operator writes.
-- Install: argocd-cm key resource.customizations.health.kubellm.io_LLMDeployment (docs/gitops.md).
local hs = {}

local function condition(kind)
  if obj.status == nil or obj.status.conditions == nil then
    return nil
  end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

-- A status written for an older spec says nothing about this one.
local generation = obj.metadata.generation
if obj.status == nil or obj.status.observedGeneration == nil
    or (generation ~= nil and obj.status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local ready = condition("Ready")
local progressing = condition("Progressing")
local degraded = condition("Degraded")

if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = degraded.reason .. ": " .. (degraded.message or "")
  return hs
end
if progressing ~= nil and progressing.status == "False" and progressing.reason == "ProgressDeadlineExceeded" then
  hs.status = "Degraded"
  hs.message = progressing.message or "the rollout exceeded its progress deadline"
  return hs
end
if ready ~= nil and ready.status == "False" and ready.reason == "ScaledToZero" then
  hs.status = "Suspended"
  hs.message = ready.message or "scaled to zero replicas"
  return hs
end
if ready ~= nil and ready.status == "True" and (progressing == nil or progressing.status ~= "True") then
  hs.status = "Healthy"
  hs.message = ready.message or ""
  return hs
end
hs.status = "Progressing"
if progressing ~= nil and progressing.status == "True" then
  hs.message = progressing.message or progressing.reason
elseif ready ~= nil then
  hs.message = ready.message or ready.reason
else
  hs.message = "waiting for status"
end
return hs
